"""`python -m kvfleet.operator`."""
from kvfleet.operator.main import main

raise SystemExit(main())
