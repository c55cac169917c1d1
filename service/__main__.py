"""`python -m pagedserve.service serve ...` (same as the `pagedserve` console script)."""

from pagedserve.service.entry import main

raise SystemExit(main())
