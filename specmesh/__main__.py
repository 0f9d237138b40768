import sys

from specmesh.cli import main

sys.exit(main())
