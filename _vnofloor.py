import runpy, sys
import hybridmem.environment as e
e.TRACE_FLOORS = {}
sys.argv = ["_vdbg.py", *sys.argv[1:]]
runpy.run_path("_vdbg.py", run_name="__main__")
