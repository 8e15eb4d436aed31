"""NCCL's room: everything the agent does with NCCL topology files (``NCCL_TOPO_FILE``).

- :mod:`agent.nccl.syntax`: the XML dialect NCCL's reader takes (``src/graph/xml.cc``), read
  into element trees; the one error of an unreadable file.
- :mod:`agent.nccl.node_file`: the node's own file (a cloud VM's, ``topology.ncclTopologyFile``
  or ``--simulate FILE``) read into facts, kept as read beside the model (``NodeFile``), and
  laid over what NVML and sysfs read.
- :mod:`agent.nccl.container_file`: a container's file, the part of the node's topology its
  GPUs use (the matching part of the node's file where there is one).
- :mod:`agent.nccl.host_dir`: the containers' files on the host (``NcclFiles``: one per host
  directory per process, owned by the mode's servers).
- :mod:`agent.nccl.sweep`: removes the files of containers the kubelet no longer lists.
"""
