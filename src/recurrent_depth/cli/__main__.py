import sys

from recurrent_depth.cli import main

sys.exit(main())
