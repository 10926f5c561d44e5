"""The local head's hooks into Ray 2.60 (``verl_lite.compat.ray_local``): in place only inside the block, and the
wait for the raylet's registration polls the GCS node table before Ray's own one-second-sleep check."""

from __future__ import annotations


def test_hooks_are_in_place_only_inside_the_block():
    from ray._private import node, ray_constants, services, utils

    from verl_lite.compat import ray_local

    def current():
        return (services.get_node, node.Node.start_api_server, node.Node.start_monitor,
                ray_constants.ENABLE_RAY_CLUSTER, utils.get_dashboard_dependency_error)

    before = current()
    with ray_local.local_head_hooks():
        inside = current()
        assert inside[0] is not before[0] and inside[1] is inside[2] is ray_local._skip_head_process
        assert inside[3] is False and inside[4] is not before[4]
    assert current() == before
    with ray_local.local_head_hooks(look_up_dependencies=False):  # a retry: Ray's own dependency check
        assert current()[4] is before[4]
    assert current() == before


def test_registration_wait_polls_the_node_table_then_asks_ray(monkeypatch):
    from ray._private import services, state

    from verl_lite.compat import ray_local

    polls, asked = [], []

    class Table:  # the GCS node table: the node registers on the 4th look
        def _initialize_global_state(self, options):
            pass

        def node_table(self):
            polls.append(1)
            alive = len(polls) >= 4
            return [{"NodeID": "other", "Alive": True}] + ([{"NodeID": "mine", "Alive": True}] if alive else [])

    monkeypatch.setattr(state, "GlobalState", Table)
    monkeypatch.setattr(services, "_get_gcs_client_options", lambda address: None)
    monkeypatch.setattr(ray_local, "REGISTER_POLL_S", 0.001)

    def rays_own(address, node_id):
        asked.append((address, node_id, len(polls)))
        return "node info"

    assert ray_local._polling_get_node(rays_own)("127.0.0.1:1", "mine") == "node info"
    assert len(polls) == 4 and asked == [("127.0.0.1:1", "mine", 4)]  # Ray's own check only once it is there


def test_dashboard_dependencies_are_found_without_being_imported():
    """Ray decides between its full and minimal dashboard agent by importing the agent's optional dependencies in
    the driver (aiohttp, opentelemetry, pydantic, ...: ~0.35 s before its raylet is spawned); the hook finds them
    instead, with Ray's answer, and imports none of them."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from ray._private import utils\n"
        "from verl_lite.compat import ray_local\n"
        "before = set(sys.modules)\n"
        "with ray_local.local_head_hooks():\n"
        "    answer = utils.get_dashboard_dependency_error()\n"
        "new = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('aiohttp', 'pydantic', 'grpc',"
        " 'prometheus_client', 'opencensus', 'aiohttp_cors'))\n"
        "print(answer, new, utils.get_dashboard_dependency_error() is None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "[]", "True"], out.stdout  # found, nothing imported; Ray's own agrees


def test_a_dependency_that_cannot_be_found_is_left_to_rays_own_check(monkeypatch):
    from verl_lite.compat import ray_local

    assert "aiohttp" in ray_local._dashboard_dependency_modules()
    assert ray_local._findable("json.decoder") and ray_local._findable("opentelemetry.proto")  # regular / namespace
    assert not ray_local._findable("json.no_such_module") and not ray_local._findable("no_such_package.module")
    rays_own = ImportError("No module named 'no_such_package'")
    check = ray_local._dependency_check_by_lookup(lambda: rays_own)
    assert check() is None
    monkeypatch.setattr(ray_local, "_dashboard_dependency_modules", lambda: ("aiohttp", "no_such_package.module"))
    assert check() is rays_own
