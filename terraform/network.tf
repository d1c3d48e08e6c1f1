# A private network for the TPU VM (only when var.network is null): no external IP on the VM;
# GCS through Private Google Access (stays on Google's network, no NAT in the data path, no NAT
# charge for checkpoint bytes); git and PyPI downloads through Cloud NAT; the only way in is SSH
# from Google's IAP range.

locals {
  create_network    = var.create_runner && var.network == null
  runner_network    = var.network != null ? var.network : one(google_compute_network.runner[*].id)
  runner_subnetwork = var.network != null ? var.subnetwork : one(google_compute_subnetwork.runner[*].id)
}

resource "google_compute_network" "runner" {
  count = local.create_network ? 1 : 0

  name                    = "${var.name_prefix}-net"
  auto_create_subnetworks = false

  depends_on = [google_project_service.apis]
}

resource "google_compute_subnetwork" "runner" {
  count = local.create_network ? 1 : 0

  name                     = "${var.name_prefix}-subnet"
  network                  = google_compute_network.runner[0].id
  region                   = local.region
  ip_cidr_range            = var.subnet_cidr
  private_ip_google_access = true

  # Flow logs, sampled: enough to see where traffic went, little to pay for.
  log_config {
    aggregation_interval = "INTERVAL_10_MIN"
    flow_sampling        = 0.1
    metadata             = "INCLUDE_ALL_METADATA"
  }
}

resource "google_compute_router" "runner" {
  count = local.create_network ? 1 : 0

  name    = "${var.name_prefix}-router"
  network = google_compute_network.runner[0].id
  region  = local.region
}

resource "google_compute_router_nat" "runner" {
  count = local.create_network ? 1 : 0

  name                               = "${var.name_prefix}-nat"
  router                             = google_compute_router.runner[0].name
  region                             = local.region
  nat_ip_allocate_option             = "AUTO_ONLY"
  source_subnetwork_ip_ranges_to_nat = "LIST_OF_SUBNETWORKS"

  subnetwork {
    name                    = google_compute_subnetwork.runner[0].id
    source_ip_ranges_to_nat = ["ALL_IP_RANGES"]
  }

  log_config {
    enable = true
    filter = "ERRORS_ONLY"
  }
}

resource "google_compute_firewall" "iap_ssh" {
  count = local.create_network && var.allow_iap_ssh ? 1 : 0

  name          = "${var.name_prefix}-allow-iap-ssh"
  network       = google_compute_network.runner[0].id
  direction     = "INGRESS"
  source_ranges = ["35.235.240.0/20"] # Identity-Aware Proxy TCP forwarding

  allow {
    protocol = "tcp"
    ports    = ["22"]
  }

  log_config {
    metadata = "INCLUDE_ALL_METADATA"
  }
}
