import sys

from tonpolicy.rollout.server.app import main

sys.exit(main())
