import sys

from hybridmem.cli import main

sys.exit(main())
