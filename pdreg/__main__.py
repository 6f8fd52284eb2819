import sys

from pdreg.cli import main

sys.exit(main())
