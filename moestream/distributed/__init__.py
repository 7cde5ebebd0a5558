"""moestream past one machine, on Ray: the remote expert tier (experts held and computed in Ray actors'
RAM, remote_experts.py and expert_worker.py) and replicas behind one endpoint (serve-ray). Ray is imported
only when one of these is asked for (cluster.py)."""
