import sys

from tonpolicy.parity.align_report import main

sys.exit(main())
