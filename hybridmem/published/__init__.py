"""Published GPU measurements (someone else's real runs) imported as dataset rows.

`importer` is the generic part: read a JSON-lines file, turn each record into a row through a
per-source adapter, write the new rows through the dataset store. An adapter is one small
module (`peft_metamathqa`, `qwen_profiling`) with `NAME` and `row(record) -> dict`; another
source of published figures is one more adapter registered in `ADAPTERS`.
"""

from hybridmem.published.importer import ADAPTERS, ImportReport, import_file

__all__ = ["ADAPTERS", "ImportReport", "import_file"]
