import sys

from colibri.cli import main

sys.exit(main())
