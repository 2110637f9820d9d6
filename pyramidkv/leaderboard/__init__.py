"""The leaderboard (`python -m pyramidkv.leaderboard`, docs/leaderboard.md): a grid of method entries x benchmark
parts (grid.py) run unit by unit through the benchmark runners (cells.py), read back into one CSV (table.py), and the
page and figure made from that CSV (page.py, outputs.py)."""
