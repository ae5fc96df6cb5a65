"""The policy layer (SPEC §7.4): every tool call passes an ordered, fail-closed chain first.

    budget -> parsed command -> path rules -> risk class -> allow | deny | ask (approval callback)

Each rule is a small object with ``check(call, ctx) -> Verdict | None``; ``None`` means "no
objection, go on". The first ``deny`` ends the chain; ``ask`` is remembered and the strictest
verdict wins (deny > ask > allow). An exception inside any rule is a ``deny`` naming it (fail
closed); so is a shell line the parser cannot read. An ``ask`` goes to the approval callback;
without one it is denied. ``yolo`` approves every ``ask`` (never a ``deny``) and is refused
unless the tools run inside an isolating sandbox (any backend but ``local``). Every decision is
appended to ``Policy.log`` with its rule, reason and the effects it was based on (the harness
writes them into the trajectory).

Default risk table (``DEFAULT_RISK_ACTIONS``): read/write/delete/execute inside the writable roots
allow; network deny (unless the task allows it); vcs_push deny; package_install ask;
process_control ask; privilege deny. Path rules: a write or delete must name a path inside the
writable roots (the workspace and /tmp); outside -> deny; only known at run time -> ask; deleting
a writable root itself -> ask. Paths are checked lexically (``..`` folded); the sandbox is the
boundary for what the lexical view cannot see (symlinks made at run time).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from k3.agent.commands import Effect, ShellParseError, resolve_path, shell_effects
from k3.errors import ConfigError

__all__ = ["ApprovalRequest", "Decision", "Policy", "PolicyContext", "Verdict", "DEFAULT_RISK_ACTIONS"]

DEFAULT_RISK_ACTIONS = {"read": "allow", "write": "allow", "delete": "allow", "execute": "allow",
                        "network": "deny", "vcs_push": "deny", "package_install": "ask",
                        "process_control": "ask", "privilege": "deny"}
_RANK = {"allow": 0, "ask": 1, "deny": 2}


@dataclass
class Verdict:
    action: str                # allow | deny | ask
    rule: str
    reason: str


@dataclass
class Decision:
    """The chain's outcome for one call; ``allowed`` is what the harness obeys."""

    tool: str
    call_id: str
    action: str                # the chain's verdict: allow | deny | ask
    allowed: bool              # after approval (ask) or yolo
    rule: str
    reason: str
    effects: list[Effect] = field(default_factory=list)
    approval: str | None = None   # for ask: "approved" | "denied" | "yolo" | "no approver"

    def as_dict(self) -> dict:
        return {"tool": self.tool, "call_id": self.call_id, "action": self.action, "allowed": self.allowed,
                "rule": self.rule, "reason": self.reason, "approval": self.approval,
                "effects": [e.as_dict() for e in self.effects]}


@dataclass
class ApprovalRequest:
    tool: str
    arguments: dict
    reason: str
    effects: list[Effect]
    call_id: str = ""


@dataclass
class PolicyContext:
    """What the rules need to know about the episode (filled in by the harness before each call)."""

    workdir: str = "/workspace"
    home: str = "/root"
    writable_roots: tuple[str, ...] = ("/workspace", "/tmp")
    allowed_tools: tuple[str, ...] = ("shell", "read", "write", "edit", "list", "submit")
    steps_left: int = 1
    submissions_left: int = 1
    wall_left: float = 1.0
    tokens_left: int | None = None
    effects: list[Effect] = field(default_factory=list)


class BudgetRule:
    name = "budget"

    def check(self, tool, args, ctx):
        if tool not in ctx.allowed_tools:
            return Verdict("deny", self.name, f"tool {tool!r} is not allowed by this task")
        if ctx.steps_left <= 0:
            return Verdict("deny", self.name, "step budget exhausted")
        if ctx.wall_left <= 0:
            return Verdict("deny", self.name, "wall-time budget exhausted")
        if tool == "submit" and ctx.submissions_left <= 0:
            return Verdict("deny", self.name, "submission budget exhausted")
        return None


class ParseRule:
    """Turns the call into effects: a shell line is parsed into commands; file tools name a path."""

    name = "parsed-command"

    def check(self, tool, args, ctx):
        if tool == "shell":
            line = args.get("command")
            if not isinstance(line, str):
                return Verdict("deny", self.name, "shell: 'command' must be a string")
            try:
                ctx.effects = shell_effects(line, ctx.workdir, ctx.home)
            except ShellParseError as e:
                return Verdict("deny", self.name, str(e))
            return None
        path = args.get("path", ".")
        if tool in ("read", "list", "write", "edit", "screenshot"):
            if not isinstance(path, str):
                return Verdict("deny", self.name, f"{tool}: 'path' must be a string")
            risk = "read" if tool in ("read", "list", "screenshot") else "write"
            p = resolve_path(path, ctx.workdir, ctx.home, tilde=False)
            ctx.effects = [Effect(risk, p, p is None, f"{tool} {path}")]
        else:
            ctx.effects = []
        return None


class PathRule:
    name = "path-rules"

    def check(self, tool, args, ctx):
        worst = None
        for e in ctx.effects:
            if e.risk not in ("write", "delete"):
                continue
            if e.path is None:
                v = Verdict("ask", self.name, f"{e.risk} of a path only known at run time ({e.detail})")
            elif e.risk == "delete" and e.path in ctx.writable_roots:
                v = Verdict("ask", self.name, f"delete of the whole {e.path} ({e.detail})")
            elif not any(e.path == r or e.path.startswith(r.rstrip("/") + "/") for r in ctx.writable_roots):
                v = Verdict("deny", self.name, f"{e.risk} outside the workspace: {e.path} ({e.detail})")
            else:
                continue
            worst = v if worst is None or _RANK[v.action] > _RANK[worst.action] else worst
        return worst


class RiskRule:
    name = "risk-class"

    def __init__(self, actions: dict[str, str]):
        self.actions = actions

    def check(self, tool, args, ctx):
        worst = None
        for e in ctx.effects:
            action = self.actions[e.risk]
            if e.risk == "execute" and e.dynamic:
                action = "ask"
            if action == "allow":
                continue
            v = Verdict(action, self.name, f"{e.risk}: {e.detail}")
            worst = v if worst is None or _RANK[v.action] > _RANK[worst.action] else worst
        return worst


class Policy:
    """The chain for one episode. ``approve(request) -> bool`` answers ``ask``; ``yolo`` approves
    every ``ask`` and needs ``sandboxed=True``; ``network=True`` lets network effects pass."""

    def __init__(self, approve: Callable[[ApprovalRequest], bool] | None = None, *, yolo: bool = False,
                 sandboxed: bool = True, network: bool = False, risk_actions: dict[str, str] | None = None):
        if yolo and not sandboxed:
            raise ConfigError("--yolo is only allowed inside an isolating sandbox "
                              "(the 'local' backend does not isolate)")
        actions = dict(DEFAULT_RISK_ACTIONS)
        if network:
            actions["network"] = "allow"
        for k, v in (risk_actions or {}).items():
            if k not in actions or v not in _RANK:
                raise ConfigError(f"policy risk_actions: {k!r} -> {v!r} (risk one of {sorted(actions)}, "
                                  f"action one of allow/deny/ask)")
            actions[k] = v
        self.approve, self.yolo = approve, yolo
        self.rules = [BudgetRule(), ParseRule(), PathRule(), RiskRule(actions)]
        self.log: list[Decision] = []

    def decide(self, tool: str, args: dict, call_id: str, ctx: PolicyContext) -> Decision:
        ctx.effects = []
        worst = None
        for rule in self.rules:
            try:
                v = rule.check(tool, args, ctx)
            except Exception as e:  # noqa: BLE001 - fail closed: a broken rule denies
                v = Verdict("deny", rule.name, f"policy error in {rule.name}: {type(e).__name__}: {e}")
            if v is None:
                continue
            if worst is None or _RANK[v.action] > _RANK[worst.action]:
                worst = v
            if v.action == "deny":
                break
        worst = worst or Verdict("allow", "default", "no rule objected")
        d = Decision(tool, call_id, worst.action, worst.action == "allow", worst.rule, worst.reason,
                     list(ctx.effects))
        if worst.action == "ask":
            d.allowed, d.approval = self._ask(ApprovalRequest(tool, dict(args), worst.reason, d.effects, call_id))
        self.log.append(d)
        return d

    def _ask(self, req: ApprovalRequest) -> tuple[bool, str]:
        if self.yolo:
            return True, "yolo"
        if self.approve is None:
            return False, "no approver"
        try:
            ok = bool(self.approve(req))
        except Exception as e:  # noqa: BLE001 - an approver that fails has not approved
            return False, f"approver failed: {type(e).__name__}"
        return ok, "approved" if ok else "denied"
