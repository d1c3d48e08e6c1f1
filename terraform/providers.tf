provider "google" {
  project = var.project
  region  = local.region
}

provider "google-beta" {
  project = var.project
  region  = local.region
}

# The AWS side is optional (var.enable_aws). Terraform configures every provider the
# configuration mentions, even when all of its resources have count = 0, and the AWS provider
# insists on credentials when it is configured. With enable_aws = false it gets placeholder
# credentials and skips every call that would check them, so a GCP-only user needs no AWS
# account; nothing is ever created or read with them (every AWS resource has count = 0 then).
provider "aws" {
  region = var.aws_region

  access_key                  = var.enable_aws ? null : "unused-aws-is-disabled"
  secret_key                  = var.enable_aws ? null : "unused-aws-is-disabled"
  skip_credentials_validation = !var.enable_aws
  skip_requesting_account_id  = !var.enable_aws
  skip_metadata_api_check     = !var.enable_aws
  skip_region_validation      = !var.enable_aws

  default_tags {
    tags = var.labels
  }
}

# The second S3 region (cross-region restore tests). Always configured, used only when
# var.aws_secondary_region is set.
provider "aws" {
  alias  = "secondary"
  region = coalesce(var.aws_secondary_region, var.aws_region)

  access_key                  = var.enable_aws ? null : "unused-aws-is-disabled"
  secret_key                  = var.enable_aws ? null : "unused-aws-is-disabled"
  skip_credentials_validation = !var.enable_aws
  skip_requesting_account_id  = !var.enable_aws
  skip_metadata_api_check     = !var.enable_aws
  skip_region_validation      = !var.enable_aws

  default_tags {
    tags = var.labels
  }
}
