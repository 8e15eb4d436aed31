"""Dynamic Resource Allocation: the agent as a DRA driver (``--mode dra``).

The kubelet plugin (registration, NodePrepareResources / NodeUnprepareResources, CDI specs,
the prepared-claims checkpoint) and the ResourceSlice publisher.
"""
