from cqk_megatron.analysis.cli import main

main()
