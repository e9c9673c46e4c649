"""What an operator's scripts rely on from the `kvpool` CLI, on real processes on 127.0.0.1: a
setting that means nothing without etcd is refused rather than ignored, and the object commands'
exit statuses tell a miss from a failure and from a usage error. Every process a test starts is
ended by its pid."""

from __future__ import annotations

from kvpool import Store
from kvpool.cli.launcher import spawn
from tests.test_cluster_surface import kvpool_cli

MASTER_ANY_PORTS = ("master", "--port", "0", "--http-port", "0")


def test_a_cluster_id_without_etcd_is_refused_but_its_variable_is_left_alone(tmp_path):
    """`--cluster-id` names the cluster in etcd; a single master took it and went on as if
    unsaid. Typed, or in the settings file, it is refused as --etcd-lease-ttl-ms is;
    KVPOOL_CLUSTER_ID, exported on a host for its HA masters, does not stop a plain master."""
    typed = kvpool_cli(*MASTER_ANY_PORTS, "--cluster-id", "prod-a")
    said = " ".join(typed.stderr.decode().split())
    assert typed.returncode == 1 and said.startswith("error: --cluster-id needs --etcd"), said
    settings = tmp_path / "kvpool.toml"
    settings.write_text('[master]\ncluster-id = "prod-a"\n')
    filed = kvpool_cli(*MASTER_ANY_PORTS, "--config", str(settings))
    said = " ".join(filed.stderr.decode().split())
    assert filed.returncode == 1 and f"(--cluster-id: from [master] in {settings})" in said, said
    master = spawn("master", list(MASTER_ANY_PORTS), tmp_path, {"KVPOOL_CLUSTER_ID": "prod-a"})
    try:
        with Store(master.info["endpoint"], token="") as store:
            assert store.cluster_status().segments == []
    finally:
        master.stop()


def test_object_commands_exit_0_done_1_failed_2_usage_3_not_found(make_cluster):
    """`kvpool get` exited 2 on a miss, click's code for a usage error, and `kvpool rm` 1 for a
    key not there, the code of a master out of reach: a script could not tell a miss (compute
    the object again) from a mistake or an outage."""
    cluster = make_cluster(1, "16MiB")
    master = ("--master", cluster.master_endpoint)
    assert kvpool_cli("put", "here", *master, stdin=b"v").returncode == 0
    assert kvpool_cli("get", "here", *master).returncode == 0
    missed = kvpool_cli("get", "absent", *master)
    assert missed.returncode == 3 and missed.stderr.strip().endswith(b"not found"), missed.stderr
    unreachable = kvpool_cli("get", "here", "--master", "127.0.0.1:1")
    assert unreachable.returncode == 1 and b"cannot reach the master" in unreachable.stderr, unreachable.stderr
    assert kvpool_cli("get", "here", "--no-such-option", *master).returncode == 2
    assert kvpool_cli("get", *master).returncode == 2  # no key
    not_removed = kvpool_cli("rm", "here", "absent", *master)
    assert not_removed.returncode == 3 and b"removed 1 of 2 object(s)" in not_removed.stderr, not_removed.stderr
    assert kvpool_cli("rm", *master).returncode == 2  # nothing named
    assert kvpool_cli("rm", "here", "--master", "127.0.0.1:1").returncode == 1
    for command, said in (((), "2 usage error, 3 not found"), (("get",), "Exit status 3 when there is none"),
                          (("rm",), "Exit status 3 when some were not removed")):  # fmt: skip
        shown = " ".join(kvpool_cli(*command, "--help").stdout.decode().split())  # where a script's author looks
        assert said in shown, shown
