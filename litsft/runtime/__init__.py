"""Process and run control below everything else: ranks and rendezvous, the run lock, preemption signals, fault points, phase timings and durable file writes. No torch."""
