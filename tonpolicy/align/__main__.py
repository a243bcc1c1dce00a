import sys

from tonpolicy.align.report import main

sys.exit(main())
