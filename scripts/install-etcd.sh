#!/usr/bin/env bash
# Install etcd (Debian's etcd-server package) for the HA and chaos tests; a no-op when present.
#
# The tests start their own etcd on 127.0.0.1 with free ports and a temporary data directory
# (LocalEtcd in kvpool/cli/launcher.py, the etcd_endpoint fixture in tests/conftest.py); they
# only need the `etcd` binary. Where it is missing they skip, saying so.
#
#     bash scripts/install-etcd.sh
set -euo pipefail

if command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install-etcd: etcd is missing and this is not root: the HA tests will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# A fresh machine may have no package lists (no candidate at all): fetch them first. Lists that
# are there but stale make the install fail on a vanished .deb: refresh them and try once more.
if ! apt-cache policy etcd-server 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    apt-get update -qq
fi
if ! apt-get install -y -qq --no-install-recommends etcd-server >/dev/null; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends etcd-server >/dev/null
fi
# Where systemd runs, the package also starts a system etcd on 2379; the tests never use it.
etcd --version | head -n 1
