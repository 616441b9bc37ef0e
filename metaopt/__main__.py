from metaopt.cli import main

raise SystemExit(main())
