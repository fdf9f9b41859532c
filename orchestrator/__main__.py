from orchestrator.warm import main

main()
