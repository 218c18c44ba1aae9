import sys

from tests.e2e.golden import main

sys.exit(main(sys.argv[1:]))
