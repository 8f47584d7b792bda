import sys

from mqnc.cli import main

sys.exit(main())
