from transformer.cli import main

main()
