from raycolo.cli.main import main

raise SystemExit(main())
