import sys

from specmesh.services.verifier.server import main

sys.exit(main())
