from iop.cli import main

main()
