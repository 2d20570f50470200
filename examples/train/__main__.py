import sys

from examples.train.cli import main

sys.exit(main())
