from mgbench.cli import main

main()
