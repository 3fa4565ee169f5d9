"""What several cases judge with (PEFT adapters and LoRA layouts, trajectories, damaged loads, verl's
restored state). Imports no case module (tests/test_layout.py)."""
