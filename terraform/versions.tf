# Terraform and provider versions. `~>` pins the major version: a new major release of a
# provider (renamed or removed arguments) never slips in through `terraform init -upgrade`.
terraform {
  required_version = ">= 1.5.0, < 2.0.0"

  required_providers {
    google = {
      source  = "hashicorp/google"
      version = "~> 7.0"
    }
    # google_tpu_v2_vm (the benchmark runner) is a beta resource: it is only in google-beta.
    google-beta = {
      source  = "hashicorp/google-beta"
      version = "~> 7.0"
    }
    aws = {
      source  = "hashicorp/aws"
      version = "~> 6.0"
    }
  }
}
