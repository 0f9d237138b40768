import sys

from specmesh.services.router.server import main

sys.exit(main())
