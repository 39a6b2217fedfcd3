"""Finding a run's first peers: bootstrap sources in order (sources.py), peers remembered
from earlier joins (remembered.py), mDNS on the LAN (mdns.py), dialable addresses
(addrs.py)."""
