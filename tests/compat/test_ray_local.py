"""The local head's hooks into Ray 2.60 (``verl_lite.compat.ray_local``): in place only inside the block, and the
wait for the raylet's registration polls the GCS node table before Ray's own one-second-sleep check."""

from __future__ import annotations


def test_hooks_are_in_place_only_inside_the_block():
    from ray._private import node, ray_constants, services

    from verl_lite.compat import ray_local

    def current():
        return (services.get_node, node.Node.start_api_server, node.Node.start_monitor,
                ray_constants.ENABLE_RAY_CLUSTER)

    before = current()
    with ray_local.local_head_hooks():
        inside = current()
        assert inside[0] is not before[0] and inside[1] is inside[2] is ray_local._skip_head_process
        assert inside[3] is False
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
