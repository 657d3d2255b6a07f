from pagedinfer.entrypoints.cli import main

raise SystemExit(main())
