#!/usr/bin/env python3
"""Kubernetes lint (suite `lint`): the manifests in deploy/kubernetes/ are well-formed YAML and
objects the API server would accept, and probe zerod the way zerod answers.

Usage: check_kubernetes.py REPOSITORY_ROOT
       check_kubernetes.py --self-test

Offline, with no cluster and no kubectl:
  - yamllint (Debian's yamllint), strict: warnings fail too;
  - a schema written from the Kubernetes API reference (v1.29) for the kinds and fields the
    manifests use: apiVersion/kind pairs, required fields, unknown fields (as kubectl
    --validate=strict refuses them), types, enumerations, names, quantities, ports, and probe
    shapes (exactly one handler; grpc needs a port);
  - what the API server or the kubelet would find later: selectors that do not match their
    template's labels, mounts of undeclared volumes, $(VAR) references to variables not defined
    before them, a StatefulSet without its headless Service, Service targetPorts no container
    names, a PodDisruptionBudget with both or neither of minAvailable and maxUnavailable;
  - zerod's side: its container probes grpc.health.v1 on its control port, liveness on service
    "" and readiness on "zerod.ranks", which daemon/control/control.c must still serve.
The ZEROD_* variables are tests/lint/check_deploy_env.py's.

Exits 0 if all holds, 1 listing every problem, 77 (skipped) without PyYAML (Debian:
python3-yaml); without yamllint the other checks run and the exit is 77 if they pass.
"""
import os
import re
import shutil
import subprocess
import sys

SKIP = 77

# ---- the schema (Kubernetes API reference, v1.29) --------------------------------------------
# A type is a scalar name, a one-element list [T] (a list of T), or the name of an object in
# OBJECTS. An object maps field names to types; '!' marks a required field.
S, I, B, Q, IOS, MAP = 'string', 'integer', 'boolean', 'quantity', 'int-or-string', 'map'
QMAP = 'map of quantities'

OBJECTS = {
    'ObjectMeta': {'name': S, 'namespace': S, 'labels': MAP, 'annotations': MAP,
                   'generateName': S},
    'LabelSelector': {'matchLabels': MAP, 'matchExpressions': ['LabelSelectorRequirement']},
    'LabelSelectorRequirement': {'key!': S, 'operator!': S, 'values': [S]},
    # v1 Service
    'Service': {'apiVersion!': S, 'kind!': S, 'metadata!': 'ObjectMeta', 'spec': 'ServiceSpec'},
    'ServiceSpec': {'type': S, 'clusterIP': S, 'clusterIPs': [S], 'selector': MAP,
                    'ports': ['ServicePort'], 'publishNotReadyAddresses': B,
                    'sessionAffinity': S, 'ipFamilyPolicy': S, 'ipFamilies': [S],
                    'externalTrafficPolicy': S, 'internalTrafficPolicy': S},
    'ServicePort': {'name': S, 'port!': I, 'targetPort': IOS, 'protocol': S, 'appProtocol': S,
                    'nodePort': I},
    # apps/v1 StatefulSet, DaemonSet
    'StatefulSet': {'apiVersion!': S, 'kind!': S, 'metadata!': 'ObjectMeta',
                    'spec!': 'StatefulSetSpec'},
    'StatefulSetSpec': {'serviceName': S, 'replicas': I, 'podManagementPolicy': S,
                        'selector!': 'LabelSelector', 'template!': 'PodTemplateSpec',
                        'updateStrategy': 'StatefulSetUpdateStrategy', 'minReadySeconds': I,
                        'revisionHistoryLimit': I},
    'StatefulSetUpdateStrategy': {'type': S, 'rollingUpdate': 'RollingUpdateStatefulSet'},
    'RollingUpdateStatefulSet': {'partition': I, 'maxUnavailable': IOS},
    'DaemonSet': {'apiVersion!': S, 'kind!': S, 'metadata!': 'ObjectMeta',
                  'spec!': 'DaemonSetSpec'},
    'DaemonSetSpec': {'selector!': 'LabelSelector', 'template!': 'PodTemplateSpec',
                      'minReadySeconds': I, 'revisionHistoryLimit': I,
                      'updateStrategy': 'DaemonSetUpdateStrategy'},
    'DaemonSetUpdateStrategy': {'type': S, 'rollingUpdate': 'RollingUpdateDaemonSet'},
    'RollingUpdateDaemonSet': {'maxUnavailable': IOS, 'maxSurge': IOS},
    # v1 Pod and its parts
    'Pod': {'apiVersion!': S, 'kind!': S, 'metadata!': 'ObjectMeta', 'spec!': 'PodSpec'},
    'PodTemplateSpec': {'metadata': 'ObjectMeta', 'spec': 'PodSpec'},
    'PodSpec': {'containers!': ['Container'], 'initContainers': ['Container'],
                'volumes': ['Volume'], 'affinity': 'Affinity',
                'securityContext': 'PodSecurityContext', 'terminationGracePeriodSeconds': I,
                'restartPolicy': S, 'nodeSelector': MAP, 'tolerations': ['Toleration'],
                'serviceAccountName': S, 'automountServiceAccountToken': B, 'hostNetwork': B,
                'hostIPC': B, 'hostPID': B, 'priorityClassName': S, 'dnsPolicy': S,
                'runtimeClassName': S, 'shareProcessNamespace': B,
                'imagePullSecrets': ['LocalObjectReference']},
    'LocalObjectReference': {'name': S},
    'Toleration': {'key': S, 'operator': S, 'value': S, 'effect': S, 'tolerationSeconds': I},
    'Container': {'name!': S, 'image': S, 'command': [S], 'args': [S], 'env': ['EnvVar'],
                  'envFrom': ['EnvFromSource'], 'ports': ['ContainerPort'],
                  'resources': 'ResourceRequirements', 'volumeMounts': ['VolumeMount'],
                  'livenessProbe': 'Probe', 'readinessProbe': 'Probe', 'startupProbe': 'Probe',
                  'securityContext': 'SecurityContext', 'imagePullPolicy': S, 'workingDir': S,
                  'stdin': B, 'tty': B, 'terminationMessagePolicy': S,
                  'lifecycle': 'Lifecycle'},
    'Lifecycle': {'postStart': 'LifecycleHandler', 'preStop': 'LifecycleHandler'},
    'LifecycleHandler': {'exec': 'ExecAction', 'httpGet': 'HTTPGetAction',
                         'tcpSocket': 'TCPSocketAction', 'sleep': 'SleepAction'},
    'SleepAction': {'seconds!': I},
    'EnvVar': {'name!': S, 'value': S, 'valueFrom': 'EnvVarSource'},
    'EnvVarSource': {'fieldRef': 'ObjectFieldSelector',
                     'resourceFieldRef': 'ResourceFieldSelector',
                     'configMapKeyRef': 'KeySelector', 'secretKeyRef': 'KeySelector'},
    'ObjectFieldSelector': {'fieldPath!': S, 'apiVersion': S},
    'ResourceFieldSelector': {'resource!': S, 'containerName': S, 'divisor': Q},
    'KeySelector': {'key!': S, 'name': S, 'optional': B},
    'EnvFromSource': {'prefix': S, 'configMapRef': 'EnvFromRef', 'secretRef': 'EnvFromRef'},
    'EnvFromRef': {'name': S, 'optional': B},
    'ContainerPort': {'containerPort!': I, 'name': S, 'protocol': S, 'hostPort': I,
                      'hostIP': S},
    'ResourceRequirements': {'requests': QMAP, 'limits': QMAP},
    'VolumeMount': {'name!': S, 'mountPath!': S, 'readOnly': B, 'subPath': S,
                    'mountPropagation': S},
    'Probe': {'exec': 'ExecAction', 'httpGet': 'HTTPGetAction', 'tcpSocket': 'TCPSocketAction',
              'grpc': 'GRPCAction', 'initialDelaySeconds': I, 'periodSeconds': I,
              'timeoutSeconds': I, 'successThreshold': I, 'failureThreshold': I,
              'terminationGracePeriodSeconds': I},
    'ExecAction': {'command': [S]},
    'HTTPGetAction': {'port!': IOS, 'path': S, 'host': S, 'scheme': S},
    'TCPSocketAction': {'port!': IOS, 'host': S},
    'GRPCAction': {'port!': I, 'service': S},
    'SecurityContext': {'runAsUser': I, 'runAsGroup': I, 'runAsNonRoot': B,
                        'allowPrivilegeEscalation': B, 'readOnlyRootFilesystem': B,
                        'privileged': B, 'capabilities': 'Capabilities',
                        'seccompProfile': 'SeccompProfile', 'procMount': S},
    'Capabilities': {'add': [S], 'drop': [S]},
    'SeccompProfile': {'type!': S, 'localhostProfile': S},
    'PodSecurityContext': {'runAsUser': I, 'runAsGroup': I, 'runAsNonRoot': B, 'fsGroup': I,
                           'supplementalGroups': [I], 'seccompProfile': 'SeccompProfile',
                           'fsGroupChangePolicy': S},
    'Volume': {'name!': S, 'hostPath': 'HostPathVolumeSource',
               'configMap': 'ConfigMapVolumeSource', 'secret': 'SecretVolumeSource',
               'emptyDir': 'EmptyDirVolumeSource'},
    'HostPathVolumeSource': {'path!': S, 'type': S},
    'ConfigMapVolumeSource': {'name': S, 'defaultMode': I, 'items': ['KeyToPath'],
                              'optional': B},
    'SecretVolumeSource': {'secretName': S, 'defaultMode': I, 'items': ['KeyToPath'],
                           'optional': B},
    'KeyToPath': {'key!': S, 'path!': S, 'mode': I},
    'EmptyDirVolumeSource': {'medium': S, 'sizeLimit': Q},
    'Affinity': {'podAffinity': 'PodAffinity', 'podAntiAffinity': 'PodAffinity'},
    'PodAffinity': {'requiredDuringSchedulingIgnoredDuringExecution': ['PodAffinityTerm'],
                    'preferredDuringSchedulingIgnoredDuringExecution':
                        ['WeightedPodAffinityTerm']},
    'PodAffinityTerm': {'labelSelector': 'LabelSelector', 'topologyKey!': S, 'namespaces': [S],
                        'namespaceSelector': 'LabelSelector'},
    'WeightedPodAffinityTerm': {'weight!': I, 'podAffinityTerm!': 'PodAffinityTerm'},
    # v1 ConfigMap
    'ConfigMap': {'apiVersion!': S, 'kind!': S, 'metadata!': 'ObjectMeta', 'data': MAP,
                  'binaryData': MAP, 'immutable': B},
    # policy/v1 PodDisruptionBudget
    'PodDisruptionBudget': {'apiVersion!': S, 'kind!': S, 'metadata!': 'ObjectMeta',
                            'spec': 'PodDisruptionBudgetSpec'},
    'PodDisruptionBudgetSpec': {'selector': 'LabelSelector', 'minAvailable': IOS,
                                'maxUnavailable': IOS, 'unhealthyPodEvictionPolicy': S},
    # networking.k8s.io/v1 NetworkPolicy
    'NetworkPolicy': {'apiVersion!': S, 'kind!': S, 'metadata!': 'ObjectMeta',
                      'spec': 'NetworkPolicySpec'},
    'NetworkPolicySpec': {'podSelector!': 'LabelSelector', 'policyTypes': [S],
                          'ingress': ['NetworkPolicyIngressRule'],
                          'egress': ['NetworkPolicyEgressRule']},
    'NetworkPolicyIngressRule': {'from': ['NetworkPolicyPeer'], 'ports': ['NetworkPolicyPort']},
    'NetworkPolicyEgressRule': {'to': ['NetworkPolicyPeer'], 'ports': ['NetworkPolicyPort']},
    'NetworkPolicyPeer': {'podSelector': 'LabelSelector', 'namespaceSelector': 'LabelSelector',
                          'ipBlock': 'IPBlock'},
    'IPBlock': {'cidr!': S, 'except': [S]},
    'NetworkPolicyPort': {'protocol': S, 'port': IOS, 'endPort': I},
}

KINDS = {
    ('v1', 'Service'): 'Service',
    ('v1', 'ConfigMap'): 'ConfigMap',
    ('v1', 'Pod'): 'Pod',
    ('apps/v1', 'StatefulSet'): 'StatefulSet',
    ('apps/v1', 'DaemonSet'): 'DaemonSet',
    ('policy/v1', 'PodDisruptionBudget'): 'PodDisruptionBudget',
    ('networking.k8s.io/v1', 'NetworkPolicy'): 'NetworkPolicy',
}

# Enumerations, by (object, field).
ENUMS = {
    ('ServicePort', 'protocol'): {'TCP', 'UDP', 'SCTP'},
    ('ContainerPort', 'protocol'): {'TCP', 'UDP', 'SCTP'},
    ('NetworkPolicyPort', 'protocol'): {'TCP', 'UDP', 'SCTP'},
    ('ServiceSpec', 'type'): {'ClusterIP', 'NodePort', 'LoadBalancer', 'ExternalName'},
    ('StatefulSetSpec', 'podManagementPolicy'): {'OrderedReady', 'Parallel'},
    ('PodSpec', 'restartPolicy'): {'Always', 'OnFailure', 'Never'},
    ('PodSpec', 'dnsPolicy'): {'ClusterFirst', 'ClusterFirstWithHostNet', 'Default', 'None'},
    ('Container', 'imagePullPolicy'): {'Always', 'IfNotPresent', 'Never'},
    ('HostPathVolumeSource', 'type'): {'', 'DirectoryOrCreate', 'Directory', 'FileOrCreate',
                                       'File', 'Socket', 'CharDevice', 'BlockDevice'},
    ('LabelSelectorRequirement', 'operator'): {'In', 'NotIn', 'Exists', 'DoesNotExist'},
    ('SeccompProfile', 'type'): {'RuntimeDefault', 'Unconfined', 'Localhost'},
    ('ObjectFieldSelector', 'fieldPath'): {
        'metadata.name', 'metadata.namespace', 'metadata.uid', 'spec.nodeName',
        'spec.serviceAccountName', 'status.hostIP', 'status.hostIPs', 'status.podIP',
        'status.podIPs'},
    ('EmptyDirVolumeSource', 'medium'): {'', 'Memory'},
    ('VolumeMount', 'mountPropagation'): {'None', 'HostToContainer', 'Bidirectional'},
}

QUANTITY = re.compile(r'^[+-]?(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[mkMGTPE]|[eE][+-]?\d+)?$')
DNS1123_LABEL = re.compile(r'^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')
DNS1123_SUBDOMAIN = re.compile(r'^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')
DNS1035_LABEL = re.compile(r'^[a-z]([-a-z0-9]*[a-z0-9])?$')
LABEL_VALUE = re.compile(r'^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$')
PORT_NAME = re.compile(r'^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')  # IANA_SVC_NAME, <= 15, a letter
ENV_NAME = re.compile(r'^[-._a-zA-Z][-._a-zA-Z0-9]*$')
RESOURCE_NAME = re.compile(r'^(cpu|memory|ephemeral-storage|hugepages-[0-9]+[KMG]i|'
                           r'[a-z0-9.-]+/[a-zA-Z0-9._-]+)$')
VAR_REF = re.compile(r'\$(\$|\(([A-Za-z_][A-Za-z0-9_]*)\))')


class Checker:
    def __init__(self):
        self.problems = []

    def bad(self, where, msg):
        self.problems.append(f'{where}: {msg}')

    # ---- types -------------------------------------------------------------------------------

    def check(self, value, typ, where, obj=None, field=None):
        if isinstance(typ, list):
            if not isinstance(value, list):
                return self.bad(where, f'expected a list, got {type(value).__name__}')
            for i, v in enumerate(value):
                self.check(v, typ[0], f'{where}[{i}]', obj, field)
            return
        if typ in OBJECTS:
            if not isinstance(value, dict):
                return self.bad(where, f'expected an object ({typ}), got {type(value).__name__}')
            fields = {k.rstrip('!'): t for k, t in OBJECTS[typ].items()}
            for k in OBJECTS[typ]:
                if k.endswith('!') and k[:-1] not in value:
                    self.bad(where, f'{typ}: required field {k[:-1]} is missing')
            for k, v in value.items():
                if k not in fields:
                    self.bad(f'{where}.{k}', f'unknown field of {typ} (known: '
                                             f'{", ".join(sorted(fields))})')
                    continue
                self.check(v, fields[k], f'{where}.{k}', typ, k)
            return
        if typ == S and not isinstance(value, str):
            self.bad(where, f'expected a string, got {value!r}')
        elif typ == I and (not isinstance(value, int) or isinstance(value, bool)):
            self.bad(where, f'expected an integer, got {value!r}')
        elif typ == B and not isinstance(value, bool):
            self.bad(where, f'expected true or false, got {value!r}')
        elif typ == IOS and not (isinstance(value, str) or
                                 (isinstance(value, int) and not isinstance(value, bool))):
            self.bad(where, f'expected an integer or a string, got {value!r}')
        elif typ == Q and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                               or isinstance(value, str) and QUANTITY.match(value)):
            self.bad(where, f'not a quantity: {value!r}')
        elif typ == QMAP:
            if not isinstance(value, dict):
                return self.bad(where, 'expected a map of resource names to quantities')
            for k, v in value.items():
                if not RESOURCE_NAME.match(str(k)):
                    self.bad(where, f'unknown resource name {k!r}')
                self.check(v, Q, f'{where}.{k}')
        elif typ == MAP:
            if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in value.items()):
                self.bad(where, f'expected a map of strings to strings (quote numbers and '
                                f'booleans), got {value!r}')
        allowed = ENUMS.get((obj, field))
        if allowed is not None and isinstance(value, str) and value not in allowed:
            self.bad(where, f'{value!r} is not one of {sorted(allowed)}')


# ---- semantics: what the API server and the kubelet would refuse later ------------------------

def check_object(ck, obj, where, objects):
    kind, api = obj.get('kind'), obj.get('apiVersion')
    typ = KINDS.get((api, kind))
    if typ is None:
        return ck.bad(where, f'apiVersion {api!r} kind {kind!r} is not one this check knows '
                             f'({sorted(KINDS)}); add it from the API reference')
    ck.check(obj, typ, where)
    meta = obj.get('metadata') or {}
    name = meta.get('name', '')
    where = f'{where} {kind}/{name}'
    name_re = DNS1035_LABEL if kind == 'Service' else DNS1123_SUBDOMAIN
    if not isinstance(name, str) or not name_re.match(name) or len(name) > 253:
        ck.bad(where, f'metadata.name {name!r} is not a valid {kind} name')
    check_labels(ck, meta.get('labels'), f'{where} metadata.labels')
    spec = obj.get('spec') or {}
    if kind in ('StatefulSet', 'DaemonSet'):
        template = spec.get('template') or {}
        selector = (spec.get('selector') or {}).get('matchLabels') or {}
        labels = (template.get('metadata') or {}).get('labels') or {}
        for k, v in selector.items():
            if labels.get(k) != v:
                ck.bad(where, f'selector {k}={v} does not match the template\'s labels {labels}')
        check_labels(ck, labels, f'{where} template labels')
        check_pod(ck, template.get('spec') or {}, f'{where} template', objects, labels)
        if kind == 'StatefulSet':
            svc = spec.get('serviceName')
            match = [o for o in objects if o.get('kind') == 'Service' and
                     (o.get('metadata') or {}).get('name') == svc]
            if not match:
                ck.bad(where, f'serviceName {svc!r}: no Service of that name in these manifests')
            elif (match[0].get('spec') or {}).get('clusterIP') != 'None':
                ck.bad(where, f'serviceName {svc!r} is not a headless Service (clusterIP: None)')
    elif kind == 'Pod':
        check_pod(ck, spec, where, objects, meta.get('labels') or {})
    elif kind == 'PodDisruptionBudget':
        n = ('minAvailable' in spec) + ('maxUnavailable' in spec)
        if n != 1:
            ck.bad(where, 'exactly one of minAvailable and maxUnavailable must be set')
    elif kind == 'Service':
        for p in spec.get('ports') or []:
            check_port(ck, p.get('port'), f'{where} port')
            tp = p.get('targetPort')
            if isinstance(tp, str):
                names = container_port_names(objects, spec.get('selector') or {})
                if tp not in names:
                    ck.bad(where, f'targetPort {tp!r} is not a port name of the containers it '
                                  f'selects ({sorted(names)})')


def check_labels(ck, labels, where):
    for k, v in (labels or {}).items():
        if not isinstance(v, str) or len(v) > 63 or not LABEL_VALUE.match(v):
            ck.bad(where, f'label {k}={v!r}: not a valid label value')


def check_port(ck, port, where):
    if isinstance(port, int) and not 1 <= port <= 65535:
        ck.bad(where, f'port {port} is not in 1..65535')


def container_port_names(objects, selector):
    names = set()
    for o in objects:
        template = (o.get('spec') or {}).get('template') or {}
        labels = (template.get('metadata') or {}).get('labels') or {}
        if selector and all(labels.get(k) == v for k, v in selector.items()):
            for c in (template.get('spec') or {}).get('containers') or []:
                names.update(p.get('name') for p in c.get('ports') or [] if p.get('name'))
    return names


def check_pod(ck, pod, where, objects, labels):
    volumes = [v.get('name') for v in pod.get('volumes') or []]
    if len(set(volumes)) != len(volumes):
        ck.bad(where, f'volume names repeat: {volumes}')
    containers = (pod.get('initContainers') or []) + (pod.get('containers') or [])
    names = [c.get('name') for c in containers]
    if len(set(names)) != len(names):
        ck.bad(where, f'container names repeat: {names}')
    for c in containers:
        cw = f'{where} container {c.get("name")}'
        if not isinstance(c.get('name'), str) or not DNS1123_LABEL.match(c.get('name', '')):
            ck.bad(cw, 'name is not a DNS-1123 label')
        for m in c.get('volumeMounts') or []:
            if m.get('name') not in volumes:
                ck.bad(cw, f'mounts volume {m.get("name")!r}, which the pod does not declare')
        ports = c.get('ports') or []
        for p in ports:
            check_port(ck, p.get('containerPort'), cw)
            n = p.get('name')
            if n is not None and (len(n) > 15 or not PORT_NAME.match(n) or
                                  not re.search('[a-z]', n)):
                ck.bad(cw, f'port name {n!r} is not an IANA service name (<= 15 characters)')
        defined = set()
        for e in c.get('env') or []:
            n = e.get('name', '')
            if not ENV_NAME.match(n):
                ck.bad(cw, f'env name {n!r} is not a valid variable name')
            if 'value' in e and 'valueFrom' in e:
                ck.bad(cw, f'env {n}: value and valueFrom are exclusive')
            for ref in VAR_REF.findall(str(e.get('value', ''))):
                if ref[0] != '$' and ref[1] not in defined:
                    ck.bad(cw, f'env {n} refers to $({ref[1]}), which is not defined before it '
                               '(Kubernetes would leave the reference as it is)')
            defined.add(n)
        for field in ('command', 'args'):
            for arg in c.get(field) or []:
                for ref in VAR_REF.findall(arg):
                    if ref[0] != '$' and ref[1] not in defined:
                        ck.bad(cw, f'{field} refers to $({ref[1]}), which is not in env')
        for probe in ('livenessProbe', 'readinessProbe', 'startupProbe'):
            p = c.get(probe)
            if p is None:
                continue
            handlers = [h for h in ('exec', 'httpGet', 'tcpSocket', 'grpc') if h in p]
            if len(handlers) != 1:
                ck.bad(cw, f'{probe}: exactly one of exec, httpGet, tcpSocket, grpc, not '
                           f'{handlers}')
            for k in ('periodSeconds', 'timeoutSeconds', 'failureThreshold', 'successThreshold'):
                if k in p and isinstance(p[k], int) and p[k] < 1:
                    ck.bad(cw, f'{probe}.{k} must be at least 1')
            if probe != 'readinessProbe' and p.get('successThreshold', 1) != 1:
                ck.bad(cw, f'{probe}.successThreshold must be 1')
            port = (p.get('grpc') or {}).get('port')
            if port is not None and port not in [q.get('containerPort') for q in ports]:
                ck.bad(cw, f'{probe}: grpc port {port} is not a port of the container')


def check_zerod_probes(ck, objects, control_c):
    """zerod's container probes its health service as zerod answers it."""
    with open(control_c) as f:
        served = f.read()
    found = False
    for o in objects:
        pod = ((o.get('spec') or {}).get('template') or {}).get('spec') or {}
        for c in pod.get('containers') or []:
            if c.get('name') != 'zerod':
                continue
            found = True
            where = f'{o.get("kind")}/{(o.get("metadata") or {}).get("name")} container zerod'
            live = (c.get('livenessProbe') or {}).get('grpc')
            ready = (c.get('readinessProbe') or {}).get('grpc')
            if not live or live.get('service', '') != '':
                ck.bad(where, 'livenessProbe must be grpc on service "" (serving while zerod '
                              'runs)')
            if not ready or ready.get('service') != 'zerod.ranks':
                ck.bad(where, 'readinessProbe must be grpc on service "zerod.ranks"')
            if ready and ready.get('service') and f'"{ready["service"]}"' not in served:
                ck.bad(where, f'readiness service {ready["service"]!r} is not served by '
                              f'{control_c} any more')
            ctl = [e.get('value', '') for e in c.get('env') or []
                   if e.get('name') == 'ZEROD_CONTROL_ADDRESS']
            for probe in (live, ready):
                if probe and ctl and not ctl[0].endswith(f':{probe.get("port")}'):
                    ck.bad(where, f'probe port {probe.get("port")} is not the control port of '
                                  f'ZEROD_CONTROL_ADDRESS={ctl[0]}')
    if not found:
        ck.bad('manifests', 'no container named zerod')


def check_tree(root):
    import yaml
    ck = Checker()
    kdir = os.path.join(root, 'deploy', 'kubernetes')
    files = sorted(os.path.join(kdir, f) for f in os.listdir(kdir) if f.endswith('.yaml'))
    objects = []
    for path in files:
        rel = os.path.relpath(path, root)
        with open(path) as f:
            try:
                docs = [d for d in yaml.safe_load_all(f) if d is not None]
            except yaml.YAMLError as e:
                ck.bad(rel, f'not YAML: {e}')
                continue
        for i, d in enumerate(docs):
            if not isinstance(d, dict):
                ck.bad(f'{rel} document {i + 1}', 'not a mapping')
                continue
            d['__where'] = f'{rel} document {i + 1}'
            objects.append(d)
    for o in objects:
        where = o.pop('__where')
        check_object(ck, o, where, objects)
    check_zerod_probes(ck, objects, os.path.join(root, 'daemon', 'control', 'control.c'))
    return files, objects, ck.problems


def self_test():
    """The checker refuses what it should (so that its silence on the tree means something)."""
    import yaml
    good = yaml.safe_load('''
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: zerod}
spec:
  serviceName: zerod
  selector: {matchLabels: {app: zerod}}
  template:
    metadata: {labels: {app: zerod}}
    spec:
      containers:
        - name: zerod
          image: zerod
          env:
            - {name: A, value: "1"}
            - {name: ZEROD_CONTROL_ADDRESS, value: "$(A):7070"}
          ports: [{name: control, containerPort: 7070}]
          livenessProbe: {grpc: {port: 7070}}
          readinessProbe: {grpc: {port: 7070, service: zerod.ranks}}
          resources: {requests: {cpu: "4", memory: 16Gi}}
''')
    svc = {'apiVersion': 'v1', 'kind': 'Service', 'metadata': {'name': 'zerod'},
           'spec': {'clusterIP': 'None', 'selector': {'app': 'zerod'},
                    'ports': [{'port': 7070, 'targetPort': 'control'}]}}
    import copy
    cases = [
        ('a good StatefulSet', lambda o: None, None),
        ('an unknown field', lambda o: o['spec']['template']['spec']['containers'][0].update(
            {'readinesProbe': {}}), 'unknown field of Container'),
        ('a missing required field', lambda o: o['spec'].pop('selector'),
         'required field selector'),
        ('two probe handlers', lambda o: o['spec']['template']['spec']['containers'][0][
            'livenessProbe'].update({'tcpSocket': {'port': 7070}}), 'exactly one of'),
        ('a grpc probe without a port', lambda o: o['spec']['template']['spec']['containers'][0][
            'livenessProbe']['grpc'].pop('port'), 'required field port'),
        ('a selector that misses', lambda o: o['spec']['selector']['matchLabels'].update(
            {'app': 'other'}), 'does not match'),
        ('a bad quantity', lambda o: o['spec']['template']['spec']['containers'][0][
            'resources']['requests'].update({'memory': '16 GB'}), 'not a quantity'),
        ('an undefined $(VAR)', lambda o: o['spec']['template']['spec']['containers'][0][
            'env'].reverse(), 'not defined before it'),
        ('a wrong apiVersion', lambda o: o.update({'apiVersion': 'apps/v1beta1'}),
         'is not one this check knows'),
        ('readiness on another service', lambda o: o['spec']['template']['spec'][
            'containers'][0]['readinessProbe']['grpc'].update({'service': 'x'}),
         'zerod.ranks'),
        ('an integer label value', lambda o: o['spec']['template']['metadata'].update(
            {'labels': {'app': 'zerod', 'n': 1}}), 'map of strings'),
    ]
    here = os.path.dirname(os.path.abspath(__file__))
    control_c = os.path.join(here, '..', '..', 'daemon', 'control', 'control.c')
    failed = 0
    for name, mutate, expect in cases:
        obj = copy.deepcopy(good)
        mutate(obj)
        ck = Checker()
        objects = [obj, svc]
        for o in objects:
            check_object(ck, o, 'test', objects)
        check_zerod_probes(ck, objects, control_c)
        ok = (not ck.problems) if expect is None else any(expect in p for p in ck.problems)
        print(f'{"ok" if ok else "FAILED"}: {name}' + ('' if ok else f': {ck.problems}'))
        failed += not ok
    return failed


def main():
    try:
        import yaml  # noqa: F401
    except ImportError:
        print('SKIP: PyYAML is not importable (Debian: python3-yaml)')
        sys.exit(SKIP)
    if sys.argv[1:] == ['--self-test']:
        sys.exit(1 if self_test() else 0)
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    files, objects, problems = check_tree(root)
    print(f'{len(objects)} objects in {len(files)} files checked against the API schema')
    skipped = False
    yamllint = shutil.which('yamllint')
    if yamllint:
        config = '{extends: default, rules: {line-length: {max: 100}}}'
        r = subprocess.run([yamllint, '-s', '-f', 'parsable', '-d', config, *files],
                           capture_output=True, text=True)
        if r.returncode != 0 or r.stdout.strip():
            problems.append(f'yamllint (exit {r.returncode}):\n{r.stdout}{r.stderr}')
        else:
            print('yamllint: ok')
    else:
        print('yamllint is not installed (Debian: yamllint): that check was skipped')
        skipped = True
    for p in problems:
        print(p)
    sys.exit(1 if problems else SKIP if skipped else 0)


if __name__ == '__main__':
    main()
