"""`python -m pagedserve.service serve ...` (same as the `pagedserve` console script)."""

from pagedserve.service.cli import main

raise SystemExit(main())
