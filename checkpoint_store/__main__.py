from checkpoint_store.cli import main

main()
