import sys

from specmesh.services.drafter.server import main

sys.exit(main())
