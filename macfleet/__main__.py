from macfleet.cli.main import main

raise SystemExit(main())
