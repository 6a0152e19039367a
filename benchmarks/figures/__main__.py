import sys

from benchmarks.figures import main

sys.exit(main())
