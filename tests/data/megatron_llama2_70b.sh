# Megatron-LM pretrain_gpt.py arguments of Llama-2-70B's shape (examples/llama style),
# t=8, p=4 with 5 virtual stages per rank, 64 GPUs (dp 2): hand-written for the tests
torchrun --nproc_per_node 8 --nnodes 8 pretrain_gpt.py \
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 \
    --group-query-attention --num-query-groups 8 --vocab-size 32000 \
    --seq-length 4096 --max-position-embeddings 4096 --swiglu --normalization RMSNorm \
    --untie-embeddings-and-output-weights --position-embedding-type rope \
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4 --sequence-parallel \
    --num-layers-per-virtual-pipeline-stage 4 \
    --micro-batch-size 1 --global-batch-size 16 --bf16 --use-distributed-optimizer \
    --use-flash-attn --clip-grad 1.0 --lr 3e-4 --train-iters 1000 --tokenizer-type Llama2Tokenizer \
    --data-path /data/llama --recompute-granularity selective --bogus-knob 3
