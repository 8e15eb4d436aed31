"""Who may do what on the stand-in API server (:mod:`apiserver_stub`): authentication by
bearer token, RBAC authorization and the project's "own node" admission policies, all read
from the project's own manifests (``daemonset/``), so a test identity has exactly the
permissions a deployed agent would have.

Upstream behaviour each part follows:

- **Request attributes** (``k8s.io/apiserver/pkg/endpoints/request.RequestInfoFactory``):
  the verb is ``get``/``list``/``watch`` for GET (a named object / a collection /
  ``?watch=true``), ``create`` for POST, ``update`` for PUT, ``patch`` for PATCH, ``delete``
  (named) or ``deletecollection`` for DELETE; the API group is ``""`` under ``/api/v1`` and
  the path segment under ``/apis/<group>/<version>``; a create request has no name.
- **Authentication**: a bearer token maps to a user name, groups and ``extra``; a service
  account's user is ``system:serviceaccount:<ns>:<name>`` in the groups
  ``system:serviceaccounts``, ``system:serviceaccounts:<ns>`` and ``system:authenticated``,
  and a pod-bound token carries ``authentication.kubernetes.io/node-name`` in ``extra``
  (``ServiceAccountTokenPodNodeInfo``, Kubernetes >= 1.30). No or an unknown token: 401.
- **RBAC** (``plugin/pkg/auth/authorizer/rbac`` and ``pkg/apis/rbac/v1/evaluation_helpers.go``
  ``RuleAllows``): a rule allows a request when its ``verbs``, ``apiGroups`` and
  ``resources`` each hold the request's value or ``*`` (``resource/subresource`` for a
  subresource) and ``resourceNames`` is empty or holds the name (so a rule with names never
  allows create, list or watch); a RoleBinding grants its Role's or ClusterRole's rules in its
  own namespace only, a ClusterRoleBinding grants a ClusterRole's rules everywhere; subjects
  are ServiceAccounts, Users and Groups. Nothing is allowed unless a rule allows it (403 with
  the authorizer's message, ``... cannot <verb> resource "<r>" in API group "<g>" in the
  namespace "<ns>"`` or ``at the cluster scope``). Discovery (``/api``, ``/apis``,
  ``/version``) is allowed to every authenticated user, as the default ``system:discovery``
  binding does.
- **The Node authorizer** (``plugin/pkg/auth/authorizer/node``) and **NodeRestriction**
  limit what *kubelets* (users ``system:node:<name>`` in ``system:nodes``) may do to
  ResourceSlices: a slice is theirs when ``spec.nodeName`` is their node. They do not apply to
  the agent, which runs under a service account, and they know nothing of NFD's NodeFeature (a
  custom resource: no node authorizer rule and no admission plugin of NFD's restricts who
  writes one; the Role lets the agent write any NodeFeature of its namespace). So the stand-in
  does not implement them, and "its own node only" comes from the project's two
  ValidatingAdmissionPolicies, below.
- **ValidatingAdmissionPolicy** (``k8s.io/apiserver/pkg/admission/plugin/policy/validating``):
  a policy bound with ``validationActions: [Deny]`` applies to the requests its
  ``matchConstraints.resourceRules`` (groups, resources, operations) and ``matchConditions``
  select; a failed validation answers 422 ``Invalid`` (a validation without ``reason``) with
  ``<resource>.<group> "<name>" is forbidden: ValidatingAdmissionPolicy '<policy>' with binding
  '<binding>' denied request: <message>``. The stand-in evaluates no CEL: it recognises the
  one expression shape the project's policies use (the user's name compared with a string;
  the user's ``authentication.kubernetes.io/node-name`` compared with a node name read from the
  object, ``spec.?nodeName`` or ``metadata.?labels[?'<key>']``, and optionally with the
  object's name, ``== "<prefix>" + variables.userNodeName``) and enforces what it says: the
  token must name a node, and the object (the old one for DELETE, the new one otherwise) must
  name that node (on DELETE only where the policy reads ``oldObject``) and be called
  ``<prefix><node>``. A policy of another shape is refused when the
  manifests are loaded, so a changed policy fails the tests instead of going unenforced.
  The "own node condition" policy (``nodes/status``, issue 35) has a shape of its own
  (:class:`OwnConditionPolicy`): the Node must be the token's node, the conditions other than
  the one its ``filter(c, c.type != '<type>')`` names must be unchanged, and so must each
  ``object.status.?<field> == oldObject.status.?<field>`` it lists. A PATCH is admitted as an
  ``UPDATE`` of the patched object (``oldObject`` the stored one).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "daemonset")
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


# ---------------------------------------------------------------------- manifests
def load_variant(*directories: str, namespace: str = "gpu-topology-agent") -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k DIR`` would apply for each of ``directories`` (paths
    under ``daemonset/`` or absolute): the files its ``kustomization.yaml`` lists under
    ``resources``, directories followed, each file once. Namespaced RBAC objects without a
    namespace get ``namespace`` (what the base's ``namespace:`` does)."""
    seen: set[str] = set()
    out: list[dict[str, Any]] = []

    def visit(path: str) -> None:
        path = os.path.normpath(path if os.path.isabs(path) else os.path.join(DEPLOY, path))
        if path in seen:
            return
        seen.add(path)
        if os.path.isdir(path):
            with open(os.path.join(path, "kustomization.yaml"), encoding="utf-8") as f:
                kustomization = yaml.safe_load(f) or {}
            for entry in kustomization.get("resources") or []:
                visit(os.path.join(path, entry))
            return
        with open(path, encoding="utf-8") as f:
            for doc in yaml.safe_load_all(f):
                if isinstance(doc, dict) and doc.get("kind"):
                    if doc["kind"] in ("Role", "RoleBinding"):
                        doc.setdefault("metadata", {}).setdefault("namespace", namespace)
                    out.append(doc)

    for directory in directories:
        visit(directory)
    return out


# ---------------------------------------------------------------------- identities
@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ()
    extra: dict[str, list[str]] = field(default_factory=dict)

    @property
    def node_name(self) -> str:
        values = self.extra.get(NODE_NAME_EXTRA) or [""]
        return values[0]


def service_account(namespace: str, name: str, node_name: str | None = None) -> User:
    """A pod-bound service account token's user (``node_name``: the pod's node)."""
    extra = {NODE_NAME_EXTRA: [node_name]} if node_name else {}
    return User(f"system:serviceaccount:{namespace}:{name}",
                ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"),
                extra)


@dataclass(frozen=True)
class Attributes:
    """What the authorizer and admission see of one request."""

    user: User
    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespace: str = ""
    name: str = ""
    resource_request: bool = True
    path: str = ""


# ---------------------------------------------------------------------- RBAC
def _rule_allows(rule: dict[str, Any], a: Attributes) -> bool:
    verbs = rule.get("verbs") or []
    if "*" not in verbs and a.verb not in verbs:
        return False
    groups = rule.get("apiGroups") or []
    if "*" not in groups and a.group not in groups:
        return False
    resources = rule.get("resources") or []
    combined = f"{a.resource}/{a.subresource}" if a.subresource else a.resource
    if not ("*" in resources or combined in resources
            or (a.subresource and f"*/{a.subresource}" in resources)):
        return False
    names = rule.get("resourceNames") or []
    return not names or a.name in names


def _subject_matches(subject: dict[str, Any], user: User, binding_namespace: str) -> bool:
    kind = subject.get("kind")
    if kind == "ServiceAccount":
        ns = subject.get("namespace") or binding_namespace
        return user.name == f"system:serviceaccount:{ns}:{subject.get('name')}"
    if kind == "User":
        return user.name == subject.get("name")
    if kind == "Group":
        return subject.get("name") in user.groups
    return False


class RbacAuthorizer:
    """RBAC over the Roles, ClusterRoles and their bindings of ``objects``."""

    def __init__(self, objects: Iterable[dict[str, Any]]) -> None:
        objects = list(objects)
        self.roles = {(o["metadata"].get("namespace", ""), o["metadata"]["name"]): o.get("rules") or []
                      for o in objects if o["kind"] == "Role"}
        self.cluster_roles = {o["metadata"]["name"]: o.get("rules") or []
                              for o in objects if o["kind"] == "ClusterRole"}
        self.bindings = [o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]

    def _rules_for(self, a: Attributes) -> list[dict[str, Any]]:
        rules: list[dict[str, Any]] = []
        for b in self.bindings:
            ns = b["metadata"].get("namespace", "") if b["kind"] == "RoleBinding" else ""
            if not any(_subject_matches(s, a.user, ns) for s in b.get("subjects") or []):
                continue
            if b["kind"] == "RoleBinding" and ns != a.namespace:
                continue  # a RoleBinding grants in its own namespace only
            ref = b["roleRef"]
            if ref["kind"] == "ClusterRole":
                rules += self.cluster_roles.get(ref["name"], [])
            elif b["kind"] == "RoleBinding":
                rules += self.roles.get((ns, ref["name"]), [])
        return rules

    def allowed(self, a: Attributes) -> bool:
        if not a.resource_request:
            return "system:authenticated" in a.user.groups  # system:discovery
        return any(_rule_allows(rule, a) for rule in self._rules_for(a))

    @staticmethod
    def forbidden_message(a: Attributes) -> str:
        what = f'{a.resource}.{a.group}' if a.group else a.resource
        named = f' "{a.name}"' if a.name else ""
        scope = f'in the namespace "{a.namespace}"' if a.namespace else "at the cluster scope"
        res = f"{a.resource}/{a.subresource}" if a.subresource else a.resource
        return (f'{what}{named} is forbidden: User "{a.user.name}" cannot {a.verb} resource "{res}"'
                f' in API group "{a.group}" {scope}')


# ---------------------------------------------------------------------- admission
_USER_IS = re.compile(r'^request\.userInfo\.username\s*==\s*"([^"]+)"$')
_USER_NODE = re.compile(
    r"^request\.userInfo\.extra\[\?'" + re.escape(NODE_NAME_EXTRA) + r"'\]\[0\]\.orValue\(''\)$")
_OBJECT_NODE = re.compile(
    r"(oldObject|object)\)?\.(?:spec\.\?(nodeName)|metadata\.\?labels\[\?'([^']+)'\])\.orValue")
_NAME_PREFIX = re.compile(r'variables\.\w+ == "([^"]+)" \+ variables\.userNodeName')


@dataclass(frozen=True)
class OwnNodePolicy:
    """One of the project's "own node" ValidatingAdmissionPolicies, as the stand-in enforces it:
    the object (the old one for DELETE, else the new one) must name the user's node at
    ``node_path`` (on DELETE only if the policy reads ``oldObject`` there) and, with
    ``name_prefix``, be named ``<name_prefix><node>``."""

    name: str
    binding: str
    groups: tuple[str, ...]
    resources: tuple[str, ...]
    operations: tuple[str, ...]
    username: str
    node_path: tuple[str, ...]  # where the object names its node
    node_on_delete: bool
    name_prefix: str | None

    def applies(self, a: Attributes, operation: str) -> bool:
        return (a.user.name == self.username and operation in self.operations
                and ("*" in self.groups or a.group in self.groups)
                and ("*" in self.resources or a.resource in self.resources))

    def _node_of(self, obj: dict[str, Any] | None) -> str:
        value: Any = obj
        for part in self.node_path:
            value = value.get(part) if isinstance(value, dict) else None
        return value if isinstance(value, str) else ""

    def denial(self, a: Attributes, operation: str, old: dict[str, Any] | None,
               new: dict[str, Any] | None) -> str | None:
        """None when allowed, else the message the API server answers with."""
        node = a.user.node_name
        obj = old if operation == "DELETE" else new
        obj_name = ((obj or {}).get("metadata") or {}).get("name", "")
        obj_node = self._node_of(obj) if operation != "DELETE" or self.node_on_delete else node
        if not node:
            message = "the agent's token names no node (a pod-bound service account token is needed)"
        elif obj_node != node or (self.name_prefix is not None and obj_name != self.name_prefix + node):
            message = (f"the agent on node {node} may only write its own node's objects,"
                       f" not {obj_name} for node {obj_node}")
        else:
            return None
        what = f"{a.resource}.{a.group}" if a.group else a.resource
        return (f'{what} "{a.name}" is forbidden: ValidatingAdmissionPolicy \'{self.name}\' with binding'
                f" '{self.binding}' denied request: {message}")


_OTHER_CONDITIONS = re.compile(r"object\.status\.\?conditions\.orValue\(\[\]\)\.filter\(c, c\.type != '([^']+)'\)")
_SAME_FIELD = re.compile(r"object\.status\.\?(\w+) == oldObject\.status\.\?(\w+)")


def _is_condition_policy(policy: dict[str, Any]) -> bool:
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    return any("nodes/status" in (r.get("resources") or []) for r in rules)


@dataclass(frozen=True)
class OwnConditionPolicy:
    """The "own node condition" policy as the stand-in enforces it (module docstring)."""

    name: str
    binding: str
    username: str
    condition_type: str
    fields: tuple[str, ...]

    def applies(self, a: Attributes, operation: str) -> bool:
        return (a.user.name == self.username and operation == "UPDATE"
                and (a.group, a.resource, a.subresource) == ("", "nodes", "status"))

    def denial(self, a: Attributes, operation: str, old: dict[str, Any] | None,
               new: dict[str, Any] | None) -> str | None:
        node = a.user.node_name
        name = ((new or {}).get("metadata") or {}).get("name", "")
        old_status, new_status = (old or {}).get("status") or {}, (new or {}).get("status") or {}

        def others(status: dict[str, Any]) -> list[Any]:
            return [c for c in status.get("conditions") or [] if c.get("type") != self.condition_type]

        if not node:
            message = "the agent's token names no node (a pod-bound service account token is needed)"
        elif name != node:
            message = f"the agent on node {node} may only write its own Node's status, not Node {name}"
        elif others(old_status) != others(new_status) or any(
                old_status.get(f) != new_status.get(f) for f in self.fields):
            message = f"the agent may change only the {self.condition_type} condition of its Node's status"
        else:
            return None
        return (f'nodes "{a.name}" is forbidden: ValidatingAdmissionPolicy \'{self.name}\' with binding'
                f" '{self.binding}' denied request: {message}")


def own_condition_policies(objects: Iterable[dict[str, Any]]) -> list[OwnConditionPolicy]:
    """The bound (Deny) policies on ``nodes/status``; ValueError for one of another shape."""
    objects = list(objects)
    bindings = {o["spec"]["policyName"]: o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"
                and "Deny" in (o["spec"].get("validationActions") or [])}
    out = []
    for policy in (o for o in objects if o["kind"] == "ValidatingAdmissionPolicy" and _is_condition_policy(o)):
        name = policy["metadata"]["name"]
        if name not in bindings:
            continue
        spec = policy["spec"]
        users = [m.group(1) for c in spec.get("matchConditions") or [] if (m := _USER_IS.match(c["expression"].strip()))]
        text = " ".join(" ".join(x["expression"].split()) for x in (spec.get("variables") or [])
                        + (spec.get("validations") or []))
        types = set(_OTHER_CONDITIONS.findall(text))
        same = [a for a, b in _SAME_FIELD.findall(text) if a == b]
        if (len(users) != 1 or len(types) != 1 or "object.metadata.name == variables.userNodeName" not in text
                or not any(_USER_NODE.match(" ".join(v["expression"].split())) for v in spec.get("variables") or [])):
            raise ValueError(f"ValidatingAdmissionPolicy {name}: not the own-node-condition shape the stand-in enforces")
        out.append(OwnConditionPolicy(name, bindings[name]["metadata"]["name"], users[0], types.pop(), tuple(same)))
    return out


def own_node_policies(objects: Iterable[dict[str, Any]]) -> list[OwnNodePolicy]:
    """The bound (Deny) ValidatingAdmissionPolicies of ``objects``; ValueError for a policy
    whose expressions are not the shape described in the module docstring."""
    objects = list(objects)
    bindings = {o["spec"]["policyName"]: o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"
                and "Deny" in (o["spec"].get("validationActions") or [])}
    out = []
    for policy in (o for o in objects if o["kind"] == "ValidatingAdmissionPolicy" and not _is_condition_policy(o)):
        name = policy["metadata"]["name"]
        if name not in bindings:
            continue
        spec = policy["spec"]
        conditions = [c["expression"].strip() for c in spec.get("matchConditions") or []]
        users = [m.group(1) for c in conditions if (m := _USER_IS.match(c))]
        variables = {v["name"]: " ".join(v["expression"].split()) for v in spec.get("variables") or []}
        paths = {(m.group(2), m.group(3)) for e in variables.values() for m in _OBJECT_NODE.finditer(e)}
        reads_old = any("oldObject" in e for e in variables.values() if _OBJECT_NODE.search(e))
        checks = " ".join(" ".join(v["expression"].split()) for v in spec.get("validations") or [])
        prefixes = _NAME_PREFIX.findall(checks)
        if (len(users) != 1 or len(conditions) != 1 or len(paths) != 1 or len(prefixes) > 1
                or not any(_USER_NODE.match(e) for e in variables.values())):
            raise ValueError(f"ValidatingAdmissionPolicy {name}: not the own-node shape the stand-in enforces")
        field_name, label = paths.pop()
        rules = spec["matchConstraints"]["resourceRules"]
        out.append(OwnNodePolicy(
            name=name, binding=bindings[name]["metadata"]["name"],
            groups=tuple(g for r in rules for g in r.get("apiGroups") or []),
            resources=tuple(x for r in rules for x in r.get("resources") or []),
            operations=tuple(x for r in rules for x in r.get("operations") or []),
            username=users[0],
            node_path=("spec", field_name) if field_name else ("metadata", "labels", label),
            node_on_delete=reads_old, name_prefix=prefixes[0] if prefixes else None))
    return out


class Access:
    """Authentication, RBAC and admission for one stand-in: tokens map to users."""

    def __init__(self, objects: Iterable[dict[str, Any]]) -> None:
        objects = list(objects)
        self.rbac = RbacAuthorizer(objects)
        self.policies: list[OwnNodePolicy | OwnConditionPolicy] = [
            *own_node_policies(objects), *own_condition_policies(objects)]
        self.tokens: dict[str, User] = {}

    @classmethod
    def from_deploy(cls, *directories: str) -> Access:
        return cls(load_variant(*directories))

    def add_token(self, token: str, user: User) -> None:
        self.tokens[token] = user

    def authenticate(self, authorization: str | None) -> User | None:
        if not authorization or not authorization.startswith("Bearer "):
            return None
        return self.tokens.get(authorization[len("Bearer "):].strip())

    def admission_denial(self, a: Attributes, operation: str, old: dict[str, Any] | None,
                         new: dict[str, Any] | None) -> str | None:
        for policy in self.policies:
            if policy.applies(a, operation):
                denial = policy.denial(a, operation, old, new)
                if denial is not None:
                    return denial
        return None
