import sys

from tonpolicy.parity.align import main

sys.exit(main())
