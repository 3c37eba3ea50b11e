from autofit._entry import main

raise SystemExit(main())
