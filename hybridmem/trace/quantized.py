"""bitsandbytes' quantised Linears emulated on meta / fake tensors, for the trace tier.

bitsandbytes is no dependency of the project, and its kernels do not run on meta tensors; these
modules hold the tensors bnb keeps per weight (`hybridmem.techniques.quantize.Quant.weight_allocs`) and
allocate in forward and backward what `bnb.nn.Linear4bit` / `MatMul4Bit` and
`bnb.nn.Linear8bitLt` / `MatMul8bitLt` (CUDA path) allocate, op output by op output (sources in
`hybridmem.techniques.quantize`). The values are never computed: only the tensors' sizes and lifetimes
matter. tests/test_quantize.py checks a traced tiny model against a real CPU run of the same
step with real `bnb.nn.Linear4bit` layers (bnb's custom ops are atomic to the tracker, so the
CPU kernels' internals do not show; their outputs are the CUDA kernels' outputs).

PEFT wraps these with `QuantLoraLinear` (registered as a custom module), which runs what
peft/tuners/lora/bnb.py `Linear4bit.forward` runs (the defensive clone of the base output, the
cast of the input to the adapter dtype outside autocast)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from hybridmem.techniques.quantize import BLOCKSIZE, Quant

DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "float32": torch.float32}
ITEM_DTYPE = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}


class Params4bit(nn.Parameter):
    """Named as bnb's packed-weight class: peft `prepare_model_for_kbit_training` skips the
    fp32 cast by this class name (a bf16 `quant_storage` would otherwise be cast)."""


class _MatMul4Bit(torch.autograd.Function):
    """bnb autograd/_functions.py `MatMul4Bit`: ctx keeps only the packed weight."""

    @staticmethod
    def forward(ctx, A, packed, bias, module):
        out = F.linear(A, module.dequantize(A.dtype), bias)
        ctx.module = module
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_output):
        grad_bias = None
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(0, dtype=ctx.bias_dtype)
        grad_a = None
        if ctx.needs_input_grad[0]:
            grad_a = torch.matmul(grad_output, ctx.module.dequantize(grad_output.dtype))
        return grad_a, None, grad_bias, None


class Linear4bit(nn.Linear):
    """`bnb.nn.Linear4bit` with `Params4bit` data and its `QuantState` tensors as buffers."""

    def __init__(self, linear: nn.Linear, quant: Quant, weight_dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.quant, self.weight_dtype = quant, weight_dtype
        self.compute_dtype = DTYPES[quant.compute_dtype]
        allocs = quant.weight_allocs(self.out_features, self.in_features)
        storage = ITEM_DTYPE[quant.storage_bytes] if quant.storage_bytes != 1 else torch.uint8
        self.weight = Params4bit(torch.empty((allocs[0].numel, 1), dtype=storage),
                                 requires_grad=False)
        # the weight's own element count: the packed data holds two 4-bit values per byte
        # (transformers `num_parameters` likewise doubles a Params4bit's numel)
        self.weight.logical_numel = self.out_features * self.in_features
        for a in allocs[1:]:
            shape = () if a.name == "offset" else (a.numel,)
            self.register_buffer(a.name.replace(".", "_"),
                                 torch.empty(shape, dtype=ITEM_DTYPE[a.itemsize]), persistent=False)
        self.bias = linear.bias

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """functional.dequantize_4bit: nested absmax first (fp32), then the full weight in
        quant_state.dtype, then `.to(A.dtype)` (MatMul4Bit)."""
        n = self.out_features * self.in_features
        absmax = None
        if self.quant.double_quant:
            absmax = torch.empty((-(-n // BLOCKSIZE),), dtype=torch.float32)
        w = torch.empty((self.out_features, self.in_features), dtype=self.weight_dtype)
        del absmax
        return w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp_dtype = x.dtype
        x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return _MatMul4Bit.apply(x, self.weight, bias, self).to(inp_dtype)


class _MatMul8bitLt(torch.autograd.Function):
    """bnb `MatMul8bitLt` (CUDA): fp16 cast of A, row-wise int8 quantisation (CA int8, SCA fp32),
    the int32 product and its dequantised output; ctx keeps A; backward dequantises CB."""

    @staticmethod
    def forward(ctx, A, cb, bias, module):
        shape = A.shape
        A2 = A.reshape(-1, shape[-1])
        a16 = A2.to(torch.float16)
        ca = torch.empty(a16.shape, dtype=torch.int8)
        sca = torch.empty((a16.shape[0],), dtype=torch.float32)
        del a16
        acc = torch.empty((A2.shape[0], module.out_features), dtype=torch.int32)
        out = torch.empty((A2.shape[0], module.out_features), dtype=A.dtype)
        del acc, ca, sca
        if bias is not None:
            out = out + bias
        ctx.module, ctx.shape, ctx.dtype = module, shape, A.dtype
        ctx.save_for_backward(A2)
        return out.reshape(*shape[:-1], module.out_features)

    @staticmethod
    def backward(ctx, grad_output):
        grad_a = None
        if ctx.needs_input_grad[0]:
            go = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
            scale = ctx.module.SCB.unsqueeze(1).mul(1.0 / 127.0)
            cb = ctx.module.weight.to(ctx.dtype, copy=True).mul_(scale)
            del scale
            grad_a = torch.matmul(go.to(ctx.dtype), cb).view(ctx.shape)
        return grad_a, None, None, None


class Linear8bitLt(nn.Linear):
    """`bnb.nn.Linear8bitLt` (has_fp16_weights=False): Int8Params CB + SCB."""

    def __init__(self, linear: nn.Linear, quant: Quant) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.quant = quant
        self.weight = nn.Parameter(torch.empty((self.out_features, self.in_features),
                                               dtype=torch.int8), requires_grad=False)
        self.register_buffer("SCB", torch.empty((self.out_features,), dtype=torch.float32),
                             persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:  # Linear8bitLt casts its bias in place
            self.bias.data = bias.data.to(x.dtype)
        return _MatMul8bitLt.apply(x, self.weight, self.bias, self)


def replace_linears(model: nn.Module, quant: Quant, weight_dtype: torch.dtype) -> int:
    """transformers `replace_with_bnb_linear`: every `type(m) is nn.Linear` the rules convert
    (`Quant.converts` on the full module name); returns how many were replaced."""
    todo = [(name, m) for name, m in model.named_modules()
            if type(m) is nn.Linear and quant.converts(name)]
    for name, m in todo:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        new = Linear4bit(m, quant, weight_dtype) if quant.four_bit else Linear8bitLt(m, quant)
        setattr(parent, leaf, new)
    return len(todo)


def quant_state_tensors(model: nn.Module):
    """(module name, tensor) of every quantisation-state tensor a real bitsandbytes layer holds
    outside `named_parameters` / `named_buffers` (QuantState absmax, code, offset, state2;
    Int8Params SCB), so the trace counts them as parameters. The emulated layers keep theirs
    as buffers, so none is returned for them."""
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        qs = getattr(w, "quant_state", None)
        if qs is not None:
            for t in (qs.absmax, qs.code, qs.offset):
                if isinstance(t, torch.Tensor):
                    yield name, t
            if qs.state2 is not None:
                yield name, qs.state2.absmax
                yield name, qs.state2.code
        scb = getattr(w, "SCB", None)
        if isinstance(scb, torch.Tensor) and not isinstance(m, Linear8bitLt):
            yield name, scb


def lora_layer_class():
    """A PEFT LoRA layer for the emulated Linears that runs peft/tuners/lora/bnb.py
    `Linear4bit.forward` (vanilla LoRA branch; variants as PEFT dispatches them)."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    class QuantLoraLinear(LoraLinear):
        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            result = self.base_layer(x, *args, **kwargs)
            result = result.clone()  # "As per Tim Dettmers, for 4bit, we need to defensively clone"
            for active in self.active_adapters:
                if active not in self.lora_A.keys():
                    continue
                lora_a, lora_b = self.lora_A[active], self.lora_B[active]
                dropout, scaling = self.lora_dropout[active], self.scaling[active]
                requires_conversion = not torch.is_autocast_enabled()
                if requires_conversion:
                    expected = result.dtype
                    x = self._cast_input_dtype(x, lora_a.weight.dtype)
                if active not in self.lora_variant:
                    output = lora_b(lora_a(dropout(x))) * scaling
                    if requires_conversion:
                        output = output.to(expected)
                    result = result + output
                else:
                    result = self.lora_variant[active].forward(
                        self, active_adapter=active, x=x, result=result)
                    if requires_conversion:
                        result = result.to(expected)
            return result

    return QuantLoraLinear


def prepare_kbit(model: nn.Module) -> None:
    """peft `prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)`: freeze
    and the fp32 casts; checkpointing (and the input grads it brings) is the spec's own
    `grad_ckpt`, switched on by the caller as for any spec."""
    from peft import prepare_model_for_kbit_training

    prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
