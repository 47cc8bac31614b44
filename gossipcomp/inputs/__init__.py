"""What gossipcomp reads from operators and shows back: the one hardened reader of operator
files (files.py) and YAML on top of it (yaml_files.py), argparse types and the flags several
commands share (arguments.py), and quoting outside input in errors (text.py). The lowest layer:
nothing here imports the rest of gossipcomp."""
