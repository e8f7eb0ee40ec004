import sys

from nearpolicy.cli import main

sys.exit(main())
