"""The plan this node follows: sized from the live records (``proto/sizing.size``: layers, slots, context),
adopted once it has held for ``PLAN_DEBOUNCE_S`` (joins come in bursts and a new plan costs a model load; at once
when a planned node is gone). The host gossips the plan it runs, so every node keeps its nodes first and every node
shows its layers. A node the elected host's plan leaves out, which holds the whole model alone, serves a replica of
it: its own plan, alone (``proto/fleet.replica_wanted``); the nodes it leaves out that hold the model only together
serve one as a split, hosted by the one with the most memory (``fleet.left_out``, ``fleet.split_replica_host``)."""

from __future__ import annotations

from meshllm.net.meshnet import MeshNet
from meshllm.proto import fleet, serving
from meshllm.proto.crypto import NodeId
from meshllm.proto.debounce import Debouncer
from meshllm.proto.layout import ModelShape, Plan, Slot, Waiting
from meshllm.proto.planner import adopt_at_once, slots_for
from meshllm.proto.record import MAX_WHY, ModelFacts, PeerRecord, Role
from meshllm.proto.sizing import Sizing, size
from meshllm.serve.options import NodeOptions
from meshllm.serve.split.hosting import Hosting

PLAN_DEBOUNCE_S = 2.0


class Replanner:
    def __init__(self, net: MeshNet, hosting: Hosting, opts: NodeOptions, me: NodeId) -> None:
        self.net, self.hosting, self.o, self.me = net, hosting, opts, me
        self.plan: Plan | Waiting | None = None
        self._debounce = Debouncer[tuple[Plan | Waiting, Sizing]](PLAN_DEBOUNCE_S, first_at_once=True)

    def layer_host(self, elected: NodeId | None, now: float) -> NodeId | None:
        """The host this node serves its layers for (the only one its rpc-server answers): the elected one, the
        host of a replica that is a split whose plan uses us, or we ourselves while we host a replica (our own
        llama-server holds our rpc-server: the elected host gets no key until we have left the replica); while
        our election settles, a sitting host it picks that plans us (``MeshCore.sitting_host_for_me``)."""
        p = self.plan
        if isinstance(p, Plan) and p.host != elected and any(a.node == self.me for a in p.assignments):
            return p.host
        if elected is None and self.net.core is not None:
            return self.net.core.sitting_host_for_me(now)
        return elected

    def hosts(self) -> bool:
        """Whether this node runs llama-server for its plan: the elected host, or a replica beside it."""
        return isinstance(self.plan, Plan) and self.plan.host == self.me

    def step(self, now: float, elected: NodeId | None, shape: ModelShape | None,
             facts: ModelFacts | None) -> Plan | Waiting | None:  # fmt: skip
        """The plan newly adopted now (None: none, or the same as before)."""
        core = self.net.core
        if core is None or facts is None:
            return None
        o, me = self.o, core.record
        if core.table.dropped(facts.source):  # `mesh-llm drop`: no plan here, neither host nor replica
            if me.role != Role.CLIENT and (me.role, me.replica, me.planned) != (Role.WORKER, False, ()):
                self.net.update(role=Role.WORKER, replica=False, planned=(), layers=(), why="")
            self.plan = None
            return None
        host_rec = core.record if elected == self.me else self.net.record(elected) if elected else None
        if host_rec is None and me.replica and self.hosts():
            # the host died and our election settles (DEBOUNCE_S: it still names the dead host, or none): a replica
            # keeps serving as it is — demoted for that moment, it stopped its llama-server, cut the answers it had
            # just taken over, and the others saw a worker where a replica stood (roles change, processes don't)
            return None

        def sized_for(host: Slot, others: list[Slot], prefer: set[NodeId], busy: frozenset[NodeId] = frozenset()
                      ) -> tuple[Plan | Waiting, Sizing]:  # fmt: skip
            assert shape is not None
            return size(shape, host, others, o.parallel, o.ctx_size, o.tuning.cache_type, split=o.tensor_split,
                        prefer=prefer, busy=busy)  # fmt: skip

        def fits_alone(r: PeerRecord) -> bool:
            return isinstance(sized_for(Slot(r.node, r.capacity, shares=r.shares, ram=r.ram), [], set())[0], Plan)

        alone = sized_for(Slot(self.me, me.capacity, shares=me.shares, ram=me.ram), [], set()) if shape else None
        replica = (alone is not None and o.tensor_split is None
                   and fleet.replica_wanted(me, host_rec, isinstance(alone[0], Plan)))  # fmt: skip
        second = None  # a replica that is a split: its host's record and the plan it runs, when that plan uses us
        if alone is not None and not replica and o.tensor_split is None and o.split_replicas:
            left = fleet.left_out(host_rec, core.alive(now), fits_alone)
            r_host = fleet.split_replica_host(left) if any(r.node == self.me for r in left) else None
            slots = slots_for(left, r_host.node, facts.fingerprint) if r_host is not None else None
            if r_host is not None and slots is not None:
                trial = sized_for(*slots, serving.keep_first(self.me, r_host.node, self.plan, r_host.planned))
                if isinstance(trial[0], Plan) and any(a.node == self.me for a in trial[0].assignments):
                    second = r_host, trial
        host = self.me if replica else second[0].node if second else elected
        replica = replica or host == self.me != elected
        role = Role.HOST if host == self.me else Role.WORKER
        if me.role != Role.CLIENT and (me.role, me.replica) != (role, replica):
            self.net.update(role=role, replica=replica)
        if host is None or shape is None:
            return None
        if second is not None:
            sized = second[1]
        elif replica and alone is not None:
            sized = alone
        else:
            slots = slots_for(core.alive(now), host, facts.fingerprint)
            if slots is None:
                return None
            keep = serving.keep_first(self.me, host, self.plan, host_rec.planned if host_rec else ())
            sized = sized_for(*slots, keep, fleet.replica_nodes(core.alive(now), host))
        alive = {r.node for r in core.alive(now)}
        runs = host_rec.planned if host_rec is not None and host == elected != self.me else None
        got = self._debounce.propose(sized, now, urgent=adopt_at_once(self.plan, sized[0], alive, runs))
        if got is None or (got[0] == self.plan and got[1] == self.hosting.sizing):
            return None
        settled, sizing = got
        self.plan = settled
        self.hosting.sizing = sizing  # with the plan it was sized for
        if host == self.me:  # every node keeps our plan's nodes first: they converge on the plan we run
            asg = settled.assignments if isinstance(settled, Plan) else ()
            self.net.update(planned=tuple(a.node for a in asg), layers=tuple((a.first, a.count) for a in asg),
                            why=settled.message()[:MAX_WHY] if isinstance(settled, Waiting) else "")  # fmt: skip
        return settled
