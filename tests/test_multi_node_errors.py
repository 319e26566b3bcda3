"""A user error in a two-host job (tests/netns.py: two real network hosts), launched as the README shows:
`toolkit launch --config_file accelerate_configs/multi_node.yaml --machine_rank R recipes/cifar.py` on each.

The missing data folder fails on global rank 0 (host 0) inside main_process_first; the three other ranks stop
quietly. Each node's `toolkit launch` must print the sentence once (host 1 learns it from the job's store:
toolkit/errors.py), print no Python traceback, and exit 2. One two-host launch.
"""

from conftest import CONFIGS, ROOT, TOOLKIT
from test_multi_node import hosts, on_both_hosts  # noqa: F401 - hosts is the module's two-host fixture

CIFAR = ROOT / "recipes" / "cifar.py"
MULTI_NODE = CONFIGS / "multi_node.yaml"


def test_a_missing_data_folder_is_said_once_per_node_and_each_node_exits_2(hosts, tmp_path):  # noqa: F811
    missing = tmp_path / "nonexistent"
    codes, logs = on_both_hosts(hosts, tmp_path, lambda rank: TOOLKIT + [
        "launch", "--config_file", MULTI_NODE, "--machine_rank", rank, "--rdzv_timeout", 60, CIFAR,
        "--dataset", "cifar10", "--data-dir", missing, "--output-dir", tmp_path / "o"], timeout=180)
    expected = f"error: cifar10 was not found in {missing}/cifar-10-batches-py and downloading it failed"
    for host, (code, log) in enumerate(zip(codes, logs)):
        # Not asserted: torch's C++ "[W ... socket.cpp] The hostname of the client socket cannot be retrieved"
        # lines on host 0, a reverse lookup of the IPv4-mapped peer address that these test hosts' DNS cannot
        # answer (the successful two-host runs print them too).
        ours = [line for line in log.splitlines() if line.startswith("error: ")]
        assert code == 2 and "Traceback" not in log and "not reached" not in log, f"host {host}:\n{log}"
        assert len(ours) == 1 and ours[0].startswith(expected), f"host {host}:\n{log}"
        print(f"host {host}: exit {code}\n{log}")
