"""Pastes benchmarks/results/<op>.md (generated from <op>.json by benchmarks/harness.py) into
README.md between the markers <!-- bench:<op> --> and <!-- /bench:<op> -->. Run after copying a
device run's results into benchmarks/results/."""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    readme_path = os.path.join(ROOT, "README.md")
    readme = open(readme_path).read()
    for op in re.findall(r"<!-- bench:(\w+) -->", readme):
        table_path = os.path.join(ROOT, "benchmarks", "results", f"{op}.md")
        if not os.path.exists(table_path):
            print(f"{op}: no results yet ({table_path})")
            continue
        table = open(table_path).read().strip()
        plot = f"\n\n![{op}](benchmarks/results/{op}.png)" if os.path.exists(table_path[:-3] + ".png") else ""
        readme = re.sub(rf"<!-- bench:{op} -->.*?<!-- /bench:{op} -->",
                        lambda _: f"<!-- bench:{op} -->\n{table}{plot}\n<!-- /bench:{op} -->", readme, flags=re.S)
        print(f"{op}: table updated")
    open(readme_path, "w").write(readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
