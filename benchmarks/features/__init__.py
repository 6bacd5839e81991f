"""What one engine feature costs or gains, each side by side with the feature off."""
