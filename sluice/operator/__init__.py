"""The Sluice operator (``sluice operator``, kopf): InferenceService → worker Deployment and
Service.

    resources.py   pure builders: spec → the desired Deployment and Service
    status.py      pure status: Deployment, Pods, Endpoints, probe → status and conditions
    kube.py        the few Kubernetes API calls, each with a timeout
    controller.py  reconcile (build → server-side apply) and status refresh, on top of kube.py
    handlers.py    kopf handlers and settings (and the RBAC the operator needs)
    main.py        ``sluice operator`` flags → kopf.run
"""
